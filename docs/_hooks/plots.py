"""The performance page's plots, drawn at build time from benchmarks/RESULTS.md.

benchmarks/plot_results.py reads the recorded tables and returns SVGs; they join the site as
generated files under ``guides/plots/``, so no plot is committed and none can go stale.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files


def _plotter(root: Path) -> Any:
    path = root / "benchmarks" / "plot_results.py"
    spec = importlib.util.spec_from_file_location("_qkv_plot_results", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def on_files(files: Files, config: Any) -> Files:
    root = Path(config["config_file_path"]).parent
    for name, svg in _plotter(root).render().items():
        files.append(File.generated(config, f"guides/plots/{name}.svg", content=svg))
    return files
