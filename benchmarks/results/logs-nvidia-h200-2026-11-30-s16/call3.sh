export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 200 python3 benchmarks/kernel.py --out $OUT/rows --ms 1,2,3,4 --sets 32 --variant r1:EXPERTD_KERNEL_GRID_ROWS=1 --variant r2:EXPERTD_KERNEL_GRID_ROWS=2 --variant r3:EXPERTD_KERNEL_GRID_ROWS=3 --path-ab-max 4 --paths "" --bt-sweep-max 0 --dec-alt-max 0 --fixed-max 0 --no-baseline 2>&1 | tail -12
python3 - <<'PY'
import json,glob
d=json.load(open(glob.glob('/'.join([__import__('os').environ['OUT'],'rows','kernel-*.json']))[0]))
for r in d['rows']:
    print(r['M'], round(r['graph_us'],2), {k:(round(v,4) if isinstance(v,float) else v) for k,v in r['path_us'].items() if 'vs' in k})
PY
timeout 200 python3 benchmarks/timeline.py --out $OUT --ms 2,64 --tag s16 2>&1 | tail -40
rm -f $OUT/rows/*.png
ls -R $OUT
