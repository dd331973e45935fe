#!/usr/bin/env bash
# Every GPU check of the project, on one CUDA machine, in under 10 minutes (`make test-gpu`):
#   1. the tests marked `gpu`: the engine against transformers, the Triton kernel, CUDA graphs,
#      seeded sampling, a trainer step, the co-serving executor, the weight codec's device path,
#      and `--engine vllm` on cuda (tests/coserve/test_coserve_vllm_gpu.py, where vLLM's CUDA
#      build is installed: in this Python, or in $GPU_VLLM_PYTHON / .venv-vllm);
#   2. two benchmarks whose figures are worth recording: `rose bench engine` (ROSE's engine
#      against transformers on the GPU) and `rose bench transfer --relay local` (the weight
#      codec on the GPU);
#   3. a summary, gpu_summary.json and gpu_summary.txt: the GPU, each step's status and time, the
#      tests passed, failed and skipped (with why), each benchmark's figures.
# Everything is written to $OUT (what the device tool brings back), else build/gpu-out. Nothing here
# is part of `make test` or CI.
#
# The device tool's machine (python3 with a CUDA torch, no network) lacks a few of the project's
# packages. Where pip reaches an index, first run `scripts/gpu_checks.sh --wheels`: it downloads
# them into build/gpu-wheels (a few MB), which the run then installs (carry that folder). What is
# still missing (a CUDA torch, a package) stops the run at once, in one line naming it.
#
# Environment: GPU_PYTHON, a Python with a CUDA torch (default: .venv/bin/python if its torch sees
# a GPU, else python3); GPU_VLLM_PYTHON, one with vLLM's CUDA build (default: .venv-vllm/bin/python
# if it has one); GPU_CHECKS_SECONDS, the whole run's limit (default 570).
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=build/gpu-wheels
# What the tests and benchmarks above import that the device image lacks (its package list is in
# the device tool's KINDS.md); the bounds are pyproject.toml's.
PACKAGES=("gguf>=0.17" "zstandard>=0.22")

if [[ ${1:-} == --wheels ]]; then
    mkdir -p "$WHEELS"
    exec python3 -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" \
        --python-version "${GPU_PY_VERSION:-3.12}" --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "${PACKAGES[@]}"
fi

OUT=${OUT:-$PWD/build/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_checks.log") 2>&1
DEADLINE=${GPU_CHECKS_SECONDS:-570}
STEPS=$(mktemp)
export PYTHONUNBUFFERED=1

die() { echo "gpu_checks: $*"; exit 2; }
cuda_torch() { "$1" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; }
cuda_vllm() {
    [[ -x $1 ]] || command -v "$1" >/dev/null || return 1
    "$1" -c 'import sys; from vllm.platforms import current_platform as p; sys.exit(not p.is_cuda())' 2>/dev/null
}

# A step: its name, its time limit in seconds (cut to what is left of the deadline; skipped under
# 30 s), its command. Its status, rc and time go to $STEPS for the summary.
step() {
    local name=$1 limit=$2 start rc status
    shift 2
    local left=$((DEADLINE - SECONDS - 15))
    ((limit > left)) && limit=$left
    if ((limit < 30)); then
        printf '%s\tskipped\t\t0\tout of time\n' "$name" >>"$STEPS"
        echo "== $name: skipped, out of time"
        return
    fi
    echo "== $name (at most ${limit} s): $*"
    start=$SECONDS
    timeout -s INT -k 20 "$limit" "$@"
    rc=$?
    case $rc in 0) status=ok ;; 124 | 137) status=timeout ;; *) status=failed ;; esac
    printf '%s\t%s\t%s\t%s\t\n' "$name" "$status" "$rc" "$((SECONDS - start))" >>"$STEPS"
    echo "== $name: $status (rc $rc, $((SECONDS - start)) s)"
}

# -- the Python, the packages, the project -------------------------------------------------------
if [[ -n ${GPU_PYTHON:-} ]]; then
    PY=$GPU_PYTHON
elif [[ -x .venv/bin/python ]] && cuda_torch .venv/bin/python; then
    PY=.venv/bin/python
else
    PY=python3
fi
cuda_torch "$PY" || die "needs a Python whose torch sees a CUDA GPU; $PY has: $("$PY" -c \
    'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "available", torch.cuda.is_available())' \
    2>&1 | tail -1)"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/rose-gpu-site "$WHEELS"/*.whl \
        || die "could not install $WHEELS/*.whl into /tmp/rose-gpu-site"
    export PYTHONPATH=/tmp/rose-gpu-site${PYTHONPATH:+:$PYTHONPATH}
fi
# The project itself, editable (the CLI reads its version from the installed metadata); where pip
# cannot build it (no setuptools>=68), the tree on the path and its metadata alone.
if ! "$PY" -c 'import importlib.metadata as m, rose, sys; m.version("rose-rl"); sys.exit(not rose.__file__.startswith(sys.argv[1]))' "$PWD" 2>/dev/null \
    && ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .; then
    version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
    mkdir -p "/tmp/rose-gpu-site/rose_rl-$version.dist-info"
    printf 'Metadata-Version: 2.1\nName: rose-rl\nVersion: %s\n' "$version" \
        >"/tmp/rose-gpu-site/rose_rl-$version.dist-info/METADATA"
    export PYTHONPATH=$PWD:/tmp/rose-gpu-site${PYTHONPATH:+:$PYTHONPATH}
fi
mapfile -t GPU_TESTS < <(grep -rlE "pytest\.mark\.gpu" tests --include='*.py' | sort)
collected=$("$PY" -m pytest -q --collect-only -m gpu -p no:cacheprovider "${GPU_TESTS[@]}" 2>&1)
missing=$(grep -oE "No module named '[^']+'" <<<"$collected" | sort -u | tr '\n' ' ')
[[ -z $missing ]] || die "the gpu tests need Python packages this machine lacks: ${missing}(run" \
    "scripts/gpu_checks.sh --wheels where pip reaches an index, add them to PACKAGES there if need be)"
grep -qE "^[0-9]+ tests? collected|^[0-9]+/[0-9]+ tests collected" <<<"$collected" \
    || die "the gpu tests do not collect: $(tail -3 <<<"$collected" | tr '\n' ' ')"
VPY=${GPU_VLLM_PYTHON:-.venv-vllm/bin/python}
echo "python: $PY; vLLM's CUDA build: $(cuda_vllm "$PY" && echo "in it" || { cuda_vllm "$VPY" && echo "in $VPY"; } \
    || echo "none (the vllm gpu tests skip)"); setup took $SECONDS s"

# -- the checks ---------------------------------------------------------------------------------
# pytest writes its JUnit XML on SIGINT too, so a timed-out step still reports what ran.
step tests_gpu 330 "$PY" -m pytest -q -m gpu -p no:cacheprovider -o junit_family=xunit1 \
    --junitxml="$OUT/tests_gpu.xml" "${GPU_TESTS[@]}"
if ! cuda_vllm "$PY" && cuda_vllm "$VPY"; then
    mapfile -t VLLM_TESTS < <(grep -lE "pytest\.mark\.vllm" "${GPU_TESTS[@]}")
    step tests_vllm_gpu 240 "$VPY" -m pytest -q -m "gpu and vllm" -p no:cacheprovider -o junit_family=xunit1 \
        --junitxml="$OUT/tests_vllm_gpu.xml" "${VLLM_TESTS[@]}"
fi
step bench_engine 120 "$PY" -m rose.cli bench engine --device cuda --json "$OUT/bench_engine.json"
# Three steps of the ~0.5 B model (docs/benchmarks.md measured four on the CPU, through Ray).
step bench_transfer 100 "$PY" -m rose.cli bench transfer --device cuda --relay local --steps 3 \
    --json "$OUT/bench_transfer.json"

"$PY" scripts/gpu_summary.py "$OUT" "$STEPS"
rc=$?
rm -f "$STEPS"
exit $rc
