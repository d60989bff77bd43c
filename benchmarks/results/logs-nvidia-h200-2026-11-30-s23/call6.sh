export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/oldsite .carry/oldtree >/tmp/oldinst.log 2>&1 || tail -5 /tmp/oldinst.log
R=$PWD
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
NEW=$(ls $R/.carry/kernels/*/libexpertd_kernels.so | head -1)
MS=16,64,256,512,1024,2048
echo "== each library on its own repack: old (session 22's tree + library) and new (the tree), A B B A A B"
for r in 0 1 2; do
  for who in old new; do
    if [ $((r % 2)) = 1 ]; then who=$([ $who = old ] && echo new || echo old); fi
    if [ $who = old ]; then
      (cd /tmp && EXPERTD_KERNEL_LIB=$R/.carry/old/libexpertd_kernels.so PYTHONPATH=/tmp/oldsite:/tmp/site timeout 120 python3 $R/.carry/oldtree/benchmarks/kernel.py --ms $MS --no-baseline --fixed-max 0 --bt-sweep-max 0 --dec-alt-max 0 --path-ab-max 0 --out /tmp/ab/r$r-old > /tmp/ab-r$r-old.log 2>&1)
    else
      EXPERTD_KERNEL_LIB=$NEW PYTHONPATH=/tmp/site timeout 120 python3 benchmarks/kernel.py --ms $MS --no-baseline --fixed-max 0 --bt-sweep-max 0 --dec-alt-max 0 --path-ab-max 0 --out /tmp/ab/r$r-new > /tmp/ab-r$r-new.log 2>&1
    fi
  done
done
python3 - <<'PY'
import json, glob, os
res = {}
for f in glob.glob("/tmp/ab/r*-*/kernel-*.json"):
    tag = f.split("/")[3]
    r, who = tag.split("-")
    for row in json.load(open(f))["rows"]:
        res.setdefault(r, {}).setdefault(who, {})[row["M"]] = (row["graph_us"], row["floor_us"], row["graph_clocks"].get("sm_mhz_median"))
json.dump(res, open(os.environ["OUT"] + "/own-repack-ab.json", "w"), indent=1)
for r in sorted(res):
    o, n = res[r].get("old", {}), res[r].get("new", {})
    print(r, " ".join(f"M={m}: {n[m][0]:.1f}/{o[m][0]:.1f}={n[m][0]/o[m][0]:.3f} ({n[m][2]:.0f}/{o[m][2]:.0f} MHz)" for m in sorted(o) if m in n))
PY
