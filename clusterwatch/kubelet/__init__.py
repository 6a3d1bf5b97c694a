"""Generated stubs of the kubelet pod-resources API (scripts/gen_protos.py); the kubelet's, not ours."""
