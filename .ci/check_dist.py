"""CI: the built wheel and sdist in DIST hold every module of src/slidetune, and the wheel declares the
`slidetune` console script. Usage: python .ci/check_dist.py DIST"""
from __future__ import annotations

import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(dist: Path) -> int:
    modules = sorted(p.relative_to(ROOT / "src").as_posix() for p in (ROOT / "src" / "slidetune").rglob("*.py"))
    wheels, sdists = sorted(dist.glob("slidetune-*.whl")), sorted(dist.glob("slidetune-*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        print(f"{dist}: expected one wheel and one sdist, found {[p.name for p in wheels + sdists]}")
        return 1
    with zipfile.ZipFile(wheels[0]) as whl:
        in_wheel = set(whl.namelist())
        entry_points = next((whl.read(n).decode() for n in in_wheel if n.endswith(".dist-info/entry_points.txt")), "")
    with tarfile.open(sdists[0]) as sdist:
        in_sdist = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    problems = [f"{wheels[0].name} lacks {m}" for m in modules if m not in in_wheel]
    problems += [f"{sdists[0].name} lacks src/{m}" for m in modules if f"src/{m}" not in in_sdist]
    if "slidetune = slidetune.cli:main" not in entry_points:
        problems.append(f"{wheels[0].name} declares no `slidetune = slidetune.cli:main` console script")
    print("\n".join(problems) or f"{wheels[0].name} and {sdists[0].name}: all {len(modules)} modules, console script")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
