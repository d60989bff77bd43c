"""A stock Triton gRPC client in its own process, driven by tests/service/test_oip_shm.py one
command at a time: JSON lines on stdin, one JSON answer line each on stdout.

Its own process because tritonclient defines the `inference.*` protobuf messages
too, so it cannot share a process with our server's stubs. Shared memory is made
and read with tritonclient.utils.shared_memory (system) and, where asked,
tritonclient.utils.cuda_shared_memory (CUDA). Usage: python oip_shm_client.py ADDRESS [TOKEN]
"""

from __future__ import annotations

import base64
import json
import sys

import ml_dtypes
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

DTYPES = {"BF16": ml_dtypes.bfloat16, "FP32": np.float32, "INT32": np.int32, "INT64": np.int64}


def array(spec: dict) -> np.ndarray:
    data = base64.b64decode(spec["data"])
    return np.frombuffer(data, dtype=DTYPES[spec["datatype"]]).reshape(spec["shape"])


def encoded(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()


class Driver:
    def __init__(self, address: str, token: str | None) -> None:
        self.client = grpcclient.InferenceServerClient(url=address)
        self.headers = {"authorization": f"Bearer {token}"} if token else None
        self.handles: dict = {}  # region name -> (the module that made it, its handle)

    @staticmethod
    def _cudashm():
        import tritonclient.utils.cuda_shared_memory as cudashm

        return cudashm

    # -- making and reading shared memory (no server involved) ------------------------

    def create(self, name: str, key: str, byte_size: int) -> dict:
        self.handles[name] = (shm, shm.create_shared_memory_region(name, key, byte_size))
        return {}

    def create_cuda(self, name: str, byte_size: int, device_id: int = 0) -> dict:
        cudashm = self._cudashm()
        handle = cudashm.create_shared_memory_region(name, byte_size, device_id)
        self.handles[name] = (cudashm, handle)
        return {}

    def put(self, name: str, tensor: dict, offset: int = 0) -> dict:
        module, handle = self.handles[name]
        if module is shm:
            shm.set_shared_memory_region(handle, [array(tensor)], offset=offset)
        else:  # CUDA regions are written from their start
            assert offset == 0
            module.set_shared_memory_region(handle, [array(tensor)])
        return {}

    def get(self, name: str, datatype: str, shape: list, offset: int = 0) -> dict:
        module, handle = self.handles[name]
        if module is shm:
            a = shm.get_contents_as_numpy(handle, DTYPES[datatype], shape, offset=offset)
        else:
            assert offset == 0
            a = module.get_contents_as_numpy(handle, DTYPES[datatype], shape)
        return {"data": encoded(a)}

    def destroy(self, name: str) -> dict:
        module, handle = self.handles.pop(name)
        module.destroy_shared_memory_region(handle)
        return {}

    # -- the server's RPCs --------------------------------------------------------------

    def register(self, name: str, key: str, byte_size: int, offset: int = 0) -> dict:
        self.client.register_system_shared_memory(
            name, key, byte_size, offset=offset, headers=self.headers
        )
        return {}

    def register_cuda(
        self, name: str, byte_size: int, device_id: int = 0, raw_handle: str | None = None
    ) -> dict:
        if raw_handle is None:
            raw_handle = self._cudashm().get_raw_handle(self.handles[name][1]).decode()
        self.client.register_cuda_shared_memory(
            name, raw_handle.encode(), device_id, byte_size, headers=self.headers
        )
        return {}

    def unregister(self, name: str = "") -> dict:
        self.client.unregister_system_shared_memory(name, headers=self.headers)
        return {}

    def unregister_cuda(self, name: str = "") -> dict:
        self.client.unregister_cuda_shared_memory(name, headers=self.headers)
        return {}

    def status(self, name: str = "") -> dict:
        reply = self.client.get_system_shared_memory_status(name, headers=self.headers)
        return {
            "regions": {
                n: {"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                for n, r in reply.regions.items()
            }
        }

    def status_cuda(self, name: str = "") -> dict:
        reply = self.client.get_cuda_shared_memory_status(name, headers=self.headers)
        return {
            "regions": {
                n: {"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size}
                for n, r in reply.regions.items()
            }
        }

    def metadata(self) -> dict:
        meta = self.client.get_server_metadata(headers=self.headers)
        return {"name": meta.name, "extensions": list(meta.extensions)}

    def infer(self, inputs: list, output: dict | None = None, layer: int = 0) -> dict:
        """inputs: [{name, datatype, shape, data}] (raw) or [{name, datatype, shape,
        region, byte_size, offset?}] (shared memory); output: {region, byte_size, offset?}
        to have the output written to shared memory."""
        tensors = []
        for spec in inputs:
            t = grpcclient.InferInput(spec["name"], list(spec["shape"]), spec["datatype"])
            if "region" in spec:
                t.set_shared_memory(spec["region"], spec["byte_size"], spec.get("offset", 0))
            else:
                t.set_data_from_numpy(array(spec))
            tensors.append(t)
        outputs = None
        if output is not None:
            out = grpcclient.InferRequestedOutput("output")
            out.set_shared_memory(output["region"], output["byte_size"], output.get("offset", 0))
            outputs = [out]
        result = self.client.infer(
            "moe", tensors, outputs=outputs, parameters={"layer": layer}, headers=self.headers
        )
        response = result.get_response()
        answer = {
            "shape": list(response.outputs[0].shape),
            "raw_lengths": [len(r) for r in response.raw_output_contents],
        }
        if output is None:
            answer["data"] = base64.b64encode(response.raw_output_contents[0]).decode()
        return answer


def main(address: str, token: str | None = None) -> None:
    driver = Driver(address, token)
    for line in sys.stdin:
        command = json.loads(line)
        try:
            answer = getattr(driver, command.pop("op"))(**command)
        except InferenceServerException as e:  # the server's answer
            answer = {"status": e.status(), "message": e.message()}
        except Exception as e:  # this side's: e.g. a host that cannot export CUDA memory
            answer = {"client_error": f"{type(e).__name__}: {e} ({e.__cause__})"}
        print(json.dumps(answer), flush=True)
    for name in list(driver.handles):
        driver.destroy(name)
    driver.client.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
