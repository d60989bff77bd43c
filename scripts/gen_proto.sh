#!/usr/bin/env bash
# Regenerate the committed gRPC stubs from proto/. Needs grpcio-tools==1.81.0 (the dev
# extra). The release is chosen for its output, not its age: stubs refuse to import under
# a grpcio older than the one that generated them, and protobuf refuses gencode newer than
# its runtime. 1.81 writes protobuf 6.33.5 gencode, which imports under protobuf 6.x (what
# tritonclient[grpc] and kserve pin) and 7.x (what grpcio 1.84 wants); see
# docs/operations.md, "Installing".
#
# inference.proto declares package `inference`, like the stubs of tritonclient and kserve.
# Its descriptors go into a private pool so the three sets can be imported in one process
# (the default pool refuses a second `inference.ServerLiveRequest`). The wire names, and
# so the service path /inference.GRPCInferenceService/..., are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
"$PY" -c 'import grpc_tools, importlib.metadata as m; v = m.version("grpcio-tools"); assert v == "1.81.0", f"grpcio-tools {v}, want 1.81.0"'
"$PY" -m grpc_tools.protoc -I proto \
  --python_out=proto --pyi_out=proto --grpc_python_out=proto \
  proto/expertd/v1/*.proto
"$PY" - proto/expertd/v1/inference_pb2.py <<'PYEOF'
import sys

path = sys.argv[1]
text = open(path).read()
default = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
private = (
    "# A private pool, not the default one: see scripts/gen_proto.sh.\n"
    "DESCRIPTOR = _descriptor_pool.DescriptorPool().AddSerializedFile("
)
if text.count(default) != 1:
    sys.exit(f"gen_proto: {path} has no single default-pool line to replace")
open(path, "w").write(text.replace(default, private))
PYEOF
echo "regenerated: $(ls proto/expertd/v1/*_pb2*.py* | tr '\n' ' ')"
