"""Regenerate the golden wire fixtures -- deliberately, never from a test.

    .venv/bin/python tests/protocol/golden/regenerate.py [--force]

Writes ``<CURRENT_VERSION>/<sample>.msgpack`` for every sample and
``<CURRENT_VERSION>/schema.json`` for every wire struct. Refuses (unless ``--force``) when
the current structs break the append-only rule against any checked-in version's schema:
then the change is not wire compatible and must be undone, not re-pinned.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from mmis.protocol import WireCodec, check_append_only, describe_all


def _load_samples() -> ModuleType:
    path = Path(__file__).resolve().parent / "samples.py"
    spec = importlib.util.spec_from_file_location("mmis_golden_samples", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="write despite schema breaks")
    args = parser.parse_args()
    golden = _load_samples()
    current = describe_all()
    problems = []
    for version in golden.versions():
        schema_path = golden.GOLDEN_DIR / version / "schema.json"
        if schema_path.exists():
            recorded = json.loads(schema_path.read_text())
            problems += [f"{version}: {p}" for p in check_append_only(recorded, current)]
    if problems and not args.force:
        print("refusing to regenerate; the wire schema is not append-only:", file=sys.stderr)
        print("\n".join(problems), file=sys.stderr)
        return 1
    out = golden.GOLDEN_DIR / golden.CURRENT_VERSION
    out.mkdir(exist_ok=True)
    codec = WireCodec()
    for sample in golden.samples():
        golden.write_frames(golden.fixture_path(sample.name), golden.encode_sample(codec, sample))
    (out / "schema.json").write_text(json.dumps(current, indent=2) + "\n")
    print(f"wrote {len(golden.samples())} fixtures and schema.json to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
