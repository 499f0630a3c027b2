"""The generated code matches the protos, and the protos follow buf STANDARD conventions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _gen_protos():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "tools" / "gen_protos.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gen_protos"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_generated_code_has_not_drifted():
    drift = _gen_protos().check()
    assert drift == [], f"run `python -m tools.gen_protos`: {drift}"


def test_check_detects_drift(tmp_path):
    mod = _gen_protos()
    mod.generate(tmp_path)
    target = tmp_path / "hicache" / "v1" / "generation_pb2.py"
    target.write_text(target.read_text() + "\n# edited by hand\n")
    assert any("generation_pb2.py" in d for d in mod.check(tmp_path))


def _files():
    from engine.server.pb import admin_pb2, common_pb2, gen_pb2

    return [common_pb2.DESCRIPTOR, gen_pb2.DESCRIPTOR, admin_pb2.DESCRIPTOR]


def test_package_and_enum_zero_values():
    for fd in _files():
        assert fd.package == "hicache.v1"
        for enum in fd.enum_types_by_name.values():
            prefix = "".join("_" + c if c.isupper() else c for c in enum.name).lstrip("_").upper()
            assert enum.values_by_number[0].name == f"{prefix}_UNSPECIFIED", enum.name
            assert all(v.name.startswith(prefix + "_") for v in enum.values), enum.name


def test_one_request_response_pair_per_rpc():
    seen = set()
    for fd in _files():
        for svc in fd.services_by_name.values():
            assert svc.name.endswith("Service")
            for m in svc.methods:
                assert m.input_type.name == f"{m.name}Request", m.full_name
                assert m.output_type.name == f"{m.name}Response", m.full_name
                assert m.input_type.name not in seen
                seen.add(m.input_type.name)
    assert {"GenerateRequest", "FlushRequest", "WatchCacheEventsRequest"} <= seen


def test_sampling_fields_with_nonzero_defaults_are_optional():
    from engine.server.pb import gen_pb2

    fields = gen_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    for name in ("max_new_tokens", "temperature", "top_p", "top_k", "skip_special_tokens"):
        assert fields[name].has_presence, name
    sp = gen_pb2.SamplingParams(temperature=0.0)
    assert sp.HasField("temperature") and not sp.HasField("top_p")
