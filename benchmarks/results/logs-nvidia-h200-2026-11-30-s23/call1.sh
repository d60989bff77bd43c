export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
TREE=$(ls $PWD/.carry/kernels/*/libexpertd_kernels.so | head -1)
L=$PWD/.carry
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader
for v in tw700 tw400; do echo "== GPU kernel tests, $v"
EXPERTD_KERNEL_LIB=$L/$v/libexpertd_kernels.so timeout 60 python3 -m pytest -q -x -m cuda tests/test_cuda_kernels.py 2>&1 | tail -1; done
echo "== A/B: once-per-item tail watch (items left 700 / 400) against the tree, 2 rounds"
timeout 150 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib tw700=$L/tw700/libexpertd_kernels.so --lib tw400=$L/tw400/libexpertd_kernels.so --rounds 2 --ms 16,32,64,128 --out $OUT/tw 2>&1 | grep -v '^ *$' | tail -10
rm -rf $OUT/tw/r*
echo "== Design bound: conversion 4 ops + no scale multiply + no token re-copies (bnd), and no HBM weight stream too (bndw); wrong results by design"
timeout 300 python3 benchmarks/lib_ab.py --lib tree=$TREE --lib bnd=$L/bnd/libexpertd_kernels.so --lib bndw=$L/bndw/libexpertd_kernels.so --rounds 1 --ms 16,64,256,512,1024,2048,4096 --out $OUT/bnd 2>&1 | grep -v '^ *$' | tail -12
python3 - <<'PY'
import json, os, glob
out = os.environ["OUT"] + "/bnd"
rows = {}
for f in sorted(glob.glob(out + "/r0-*/*.json")):
    name = f.split("/r0-")[1].split("/")[0]
    for r in json.load(open(f))["rows"]:
        rows.setdefault(r["M"], {})[name] = (r["graph_us"], r["floor_us"], r.get("graph_clocks"))
json.dump({str(k): v for k, v in rows.items()}, open(out + "/x-floor.json", "w"), indent=1)
print("M      " + "  ".join(f"{n:>14}" for n in ("tree", "bnd", "bndw")))
for m, v in sorted(rows.items()):
    print(f"{m:<6} " + "  ".join(f"{v[n][0]:7.1f} {v[n][0]/v[n][1]:5.2f}x" if n in v else " " * 14 for n in ("tree", "bnd", "bndw")))
PY
rm -rf $OUT/bnd/r*
