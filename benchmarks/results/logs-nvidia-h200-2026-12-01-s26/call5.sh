# Session 26, call 5: py-spy of the client process (ExpertClient, 8 muse-spark shards on the H200)
# at M = 64 then 256 (the numpy combine), 10 s each; per-thread CPU per call from /proc.
export PYTHONUNBUFFERED=1 EXPERTD_KERNEL_CACHE=$PWD/.carry/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 300 /tmp/site/bin/py-spy record --rate 250 --threads --native -f raw -o $OUT/spy-client.txt -- python3 .carry/client_prof.py 2>&1 | grep -v "^py-spy>" | tail -20
gzip -9 $OUT/spy-client.txt; ls -la $OUT
