"""The project's fixed layout (DESIGN.md): each layer is exactly one module, and
only platform code behind the kernels' Backend seam lives in files of its own."""
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "nanoserve"
LAYERS = {"entry.py", "engine.py", "scheduler.py", "kvcache.py", "model.py", "kernels.py"}
PLATFORM = {"cpu_backend.py", "cpu_kernels.py"}  # behind kernels.Backend, off the reading path
ENTRY_POINTS = {"__init__.py", "__main__.py"}


def test_each_layer_is_one_module():
    modules = {p.name for p in PACKAGE.glob("*.py")}
    extra = sorted(modules - LAYERS - PLATFORM - ENTRY_POINTS)
    assert not extra, (f"nanoserve/ may hold only the six layer modules, __init__/__main__ and the CPU "
                       f"platform files; fold {extra} into the layer it belongs to (an entry-layer file "
                       f"such as protocol.py or cli_args.py goes into entry.py, kept compact)")
    assert LAYERS <= modules


def test_platform_code_stays_off_the_reading_path():
    """Only model.py (select_backend, the process settings tune_process and
    release_idle_memory) may reach the CPU platform files."""
    for name in LAYERS - {"model.py"}:
        text = (PACKAGE / name).read_text()
        assert "cpu_backend" not in text.replace("cpu_backend.py", "") or name == "kernels.py", name
        assert "import cpu_kernels" not in text and "from nanoserve.cpu" not in text, name
