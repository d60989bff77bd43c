#!/usr/bin/env bash
# Regenerate the committed gRPC stubs from proto/. Needs grpcio-tools==1.84.0
# (the dev extra): stubs refuse to import under a grpcio older than the one
# that generated them, and the device machine has grpcio 1.84.0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
"$PY" -c 'import grpc_tools, importlib.metadata as m; v = m.version("grpcio-tools"); assert v == "1.84.0", f"grpcio-tools {v}, want 1.84.0"'
"$PY" -m grpc_tools.protoc -I proto \
  --python_out=proto --pyi_out=proto --grpc_python_out=proto \
  proto/expertd/v1/*.proto
echo "regenerated: $(ls proto/expertd/v1/*_pb2*.py* | tr '\n' ' ')"
