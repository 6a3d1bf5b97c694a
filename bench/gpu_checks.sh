#!/bin/sh
# Every check that needs a GPU, in one command, for a machine with an NVIDIA GPU, its driver and a
# CUDA build of torch (clusterwatch and its dependencies installed). Writes one file per check.
# Usage: bench/gpu_checks.sh OUT_DIR
set -u
out=${1:?usage: bench/gpu_checks.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
{ nvidia-smi; nvidia-smi topo -m; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'; } >"$out/machine.txt" 2>&1
python3 -m bench.gpu_probe --load-s 2 >"$out/probe.txt" 2>&1
python3 -m pytest -p no:cacheprovider -v -rs --durations=0 tests/agent/test_gpu_real_nvml.py tests/hook/test_gpu_cuda_timing.py tests/e2e/test_gpu_e2e.py >"$out/pytest.txt" 2>&1
python3 -m bench.hook_overhead --workloads gpu --nproc 1 --rounds 4 --calls 0 >"$out/overhead.txt" 2>&1
tail -n 3 "$out"/*.txt
