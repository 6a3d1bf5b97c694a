"""Generated stubs of the subset of etcd's v3 API the coordinators call (scripts/gen_protos.py); etcd's, not ours."""
