"""`scripts/setup` says each step as it goes, with its time: otherwise it is silent for a
minute or more (pip runs quiet, then the compiled checks build). Run here offline, with
stand-ins for `python3`, the environment's `python` and `graphsafe`, which record what
they were asked to do."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_PYTHON3 = """#!/usr/bin/env bash
# python3 -m venv DIR: DIR/bin/python and DIR/bin/graphsafe, stand-ins that record calls.
[ "$1 $2" = "-m venv" ] || exit 3
mkdir -p "$3/bin"
cat > "$3/bin/python" <<'EOF'
#!/usr/bin/env bash
echo "python $*" >> "$(dirname "$0")/calls"
if [ "$1" = "-c" ]; then echo "torch 2.13.0+cpu"; fi
EOF
cat > "$3/bin/graphsafe" <<'EOF'
#!/usr/bin/env bash
echo "graphsafe $*" >> "$(dirname "$0")/calls"
echo "graphsafe native build: built it"
EOF
chmod +x "$3/bin/python" "$3/bin/graphsafe"
"""

_NO_GPU = "#!/usr/bin/env bash\nexit 1\n"  # nvidia-smi: no GPU visible


def _run_setup(tmp_path: Path) -> tuple[str, list[str]]:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup", repo / "scripts" / "setup")
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in (("python3", _PYTHON3), ("nvidia-smi", _NO_GPU)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(stat.S_IRWXU)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_INDEX_URL"}
    env["PATH"] = f"{stubs}{os.pathsep}{env['PATH']}"
    done = subprocess.run(["bash", str(repo / "scripts" / "setup")], capture_output=True,
                          text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout, (repo / ".venv" / "bin" / "calls").read_text().splitlines()


def test_setup_says_each_step_with_its_time_as_it_goes(tmp_path: Path) -> None:
    out, _ = _run_setup(tmp_path)
    lines = out.splitlines()
    steps = ["creating the environment", "installing torch", "installing graphsafe",
             "building the compiled checks"]
    at = 0
    for step in steps:  # said as it starts, then with its time when it ends, in order
        started = next(i for i, line in enumerate(lines) if step in line and
                       line.endswith(" ..."))
        ended = next(i for i, line in enumerate(lines) if line.startswith("graphsafe setup")
                     and f"{step}: done in " in line)
        assert at <= started < ended, (step, out)
        assert re.fullmatch(r"graphsafe setup \[ *\d+ s\] .+: done in \d+ s", lines[ended])
        at = ended
    assert lines[-1].startswith("graphsafe installed in .venv (torch 2.13.0+cpu) in ")


def test_setup_installs_the_pinned_cpu_torch_then_graphsafe_then_builds(
    tmp_path: Path,
) -> None:
    """The steps it says are the steps it takes: without a GPU, torch pinned (never an
    unpinned `torch`, which would be a CUDA build), then graphsafe, then the build."""
    _, calls = _run_setup(tmp_path)
    assert calls[:4] == [
        "python -m pip install -q --upgrade pip",
        "python -m pip install -q torch==2.13.0",
        "python -m pip install -q -e .[test]",
        "graphsafe native build",
    ]
