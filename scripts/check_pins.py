"""Whether every ``name==version`` argument is installed in the running interpreter's environment: prints what is
not (missing, or another version) and exits 1; exits 0 otherwise. Used by the virtualenv scripts
(scripts/install_anchors.sh, scripts/setup_vllm_compat.sh) as ``VENV/bin/python scripts/check_pins.py PIN...``."""

import sys
from importlib.metadata import PackageNotFoundError, version

bad = []
for spec in sys.argv[1:]:
    name, _, want = spec.partition("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        bad.append(f"{name} missing")
        continue
    if have != want:
        bad.append(f"{name} {have} != {want}")
if bad:
    print("; ".join(bad))
    sys.exit(1)
