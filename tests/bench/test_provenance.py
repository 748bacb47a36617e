"""A results file names the native builds its run loaded (their names carry a hash of the sources they were built
from: a build is made at first use, perhaps from sources newer than the run's starting commit) and the code
version as the file was written."""

from __future__ import annotations

import json

from sluice.benchmarks.common import code_version, save_json
from sluice.engine import select
from sluice.engine.native import extension


def test_a_results_file_names_the_builds_it_ran_and_the_code_at_save(tmp_path):
    available = select._EXT.why_unavailable(wait=True) is None  # (built now if it must be)
    save_json(tmp_path / "r.json", {"rows": [1, 2]})
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["rows"] == [1, 2] and saved["code_at_save"] == code_version()
    assert saved["native_kernels"] == extension.LOADED
    if available:  # the build loaded above: its name, hash and all
        assert any(name.startswith("sluice_select_") and len(name) > len("sluice_select_") + 8
                   for name in saved["native_kernels"])
