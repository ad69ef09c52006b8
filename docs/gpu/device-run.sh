#!/usr/bin/env bash
# One shot on a lent GPU machine (docs/gpu/README.md): run from the repo's root there, with .gpu/
# carried (`make gpu-wheels`) and $OUT set; everything it measured lands in $OUT.
#   bash docs/gpu/device-run.sh [GPUCHECK ARGS...]   e.g. --budget-s 330, --only sweep, --dry-run
# Then, in what time is left (KERNEL_TESTS_S, default 90 s), tests/test_kernels.py on the device:
# its bf16 cases run only on a GPU.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
: "${OUT:?set OUT to the folder the results go to}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv \
  >"$OUT/nvidia-smi.txt" 2>&1 || true
# What the image lacks (msgspec, traitlets) from the carried wheels, beside the image's packages
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/wb-site "$ROOT"/.gpu/wheels/*.whl || exit 2
# The checkout as installed: kernels/ is imported as workbench_kernels
mkdir -p /tmp/wb && ln -sfn "$ROOT/workbench" /tmp/wb/workbench && ln -sfn "$ROOT/kernels" /tmp/wb/workbench_kernels
export PYTHONPATH=/tmp/wb:/tmp/wb-site

# Outside the repo's root: python -m puts the working directory first on sys.path, where kernels/
# would stand for Hugging Face's `kernels` package
(cd /tmp && python3 -m workbench.cli gpucheck --output "$OUT/gpucheck.json" "$@") 2>&1 | tee "$OUT/gpucheck.log" |
  grep --line-buffered '^\[gpucheck' | tail -n 40
status=${PIPESTATUS[0]}
[ -f "$OUT/gpucheck.md" ] && cat "$OUT/gpucheck.md"

if [ "${KERNEL_TESTS_S:-90}" -gt 0 ]; then
  (cd "$ROOT" && timeout "${KERNEL_TESTS_S:-90}" python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py) \
    >"$OUT/test_kernels.log" 2>&1
  echo "tests/test_kernels.py: exit $? (124: out of time)"
  tail -n 15 "$OUT/test_kernels.log"
fi
exit "$status"
