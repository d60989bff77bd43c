#!/usr/bin/env bash
# Prepare what benchmarks/gpu_check.sh needs on a GPU machine that has no package index
# (Python 3.12, torch with CUDA, grpcio, protobuf, safetensors already there), on this
# machine, into the git-ignored .whl/ and .carry/ beside the tree:
#   .whl/*.whl                grpcio-health-checking, grpcio-reflection (pure Python)
#   .whl/nixl-site.txz        nixl-cu13 for cp312, installed and slimmed to its UCX plugin
#                             (the wheel is 59 MB; this archive about 10 MB)
#   .whl/hf/*.whl             transformers and its pure-Python needs (HF=1: the example)
#   .carry/libexpertd_kernels.so  the kernel library, built here by nvcc (no GPU needed)
#   .carry/base/              BASE=<commit>: that commit's product tree (no tests, docs or
#                             results) and its own kernel library, built here, for
#                             gpu_check.sh's BENCH_AB before/after runs
#
#   bash scripts/gpu_carry.sh            # HF=1 bash scripts/gpu_carry.sh for the example
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo "$PWD/.venv/bin/python" || echo python3)}  # `make test` made .venv
GRPC=${GRPC_VERSION:-1.84.0}
NIXL=${NIXL_VERSION:-1.5.1}
PLAT=(--python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --only-binary=:all:)
mkdir -p .whl .carry
$PY -m pip download -q --no-deps -d .whl "grpcio-health-checking==$GRPC" "grpcio-reflection==$GRPC"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
$PY -m pip download -q --no-deps "${PLAT[@]}" -d "$tmp" "nixl-cu13==$NIXL"
mkdir "$tmp/site"
(cd "$tmp/site" && $PY -m zipfile -e "$tmp"/nixl_cu13-*.whl .)
# Only the UCX backend is used: drop the other plugins, the expert-parallel kernels and
# the libraries only they load.
rm -rf "$tmp/site"/nixl_ep_cu13* "$tmp/site"/nixl_cu13.scripts "$tmp/site"/nixl_cu13.libs/ucx/libucx_perftest*
find "$tmp/site/nixl_cu13.libs/nixl" "$tmp/site/.nixl_cu13.mesonpy.libs/plugins" -type f \
  ! -name libplugin_UCX.so -delete
(cd "$tmp/site/nixl_cu13.libs" && rm -f libaws* libazure* libs2n* libcurl* libxml2* libgusli* \
  libaio* liburing* libcore-* libpull-*)
tar -cJf .whl/nixl-site.txz -C "$tmp/site" .

if [ "${HF:-0}" = 1 ]; then
  rm -rf .whl/hf && mkdir -p .whl/hf
  $PY -m pip download -q "${PLAT[@]}" -d "$tmp/hf" "transformers==${TRANSFORMERS_VERSION:-5.25.0}"
  # What the GPU machine has already stays out, and so does the hub's `kernels` package:
  # on PYTHONPATH it would shadow this project's kernels/.
  for w in "$tmp"/hf/*.whl; do
    case $(basename "$w") in numpy* | safetensors* | typing_extensions* | filelock* | fsspec* | kernels-*) ;;
      *) cp "$w" .whl/hf/ ;; esac
  done
fi

rm -rf .carry/base
if [ -n "${BASE:-}" ]; then
  mkdir -p .carry/base
  git archive "$BASE" -- . ':!benchmarks/results' ':!docs' ':!tests' | tar -x -C .carry/base
  # Its own library: the C functions the two trees call may differ. Every .cu of its
  # kernels/csrc is a source of the library, with this tree's flags.
  flags=$($PY -c "from expertd.kernels.build import NVCC_FLAGS; print(' '.join(NVCC_FLAGS))")
  nvcc=$($PY -c "from expertd.kernels.build import find_nvcc; print(find_nvcc())")
  # shellcheck disable=SC2086
  "$nvcc" $flags -o .carry/base/libexpertd_kernels.so .carry/base/kernels/csrc/*.cu \
    >"$tmp/base-build.log" 2>&1 || { tail -20 "$tmp/base-build.log"; exit 1; }
fi

lib=$($PY -m expertd build-kernels | tail -1)
cp "$lib" .carry/libexpertd_kernels.so
du -sh .whl .carry
echo "carry: [\".whl\", \".carry\"] (64 MiB at most with the tree)"
