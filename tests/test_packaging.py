"""`pip install .` (not editable) gives a server that finds everything it serves or builds: the
chat page (frontend/web/) and the native kernels' sources (workers/cpu/csrc/)."""

import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_carries_the_page_and_the_kernel_sources_and_an_install_serves_the_page(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".cache", "build", "dist", "*.egg-info",
                                                                 "__pycache__", "node_modules", ".pytest_cache",
                                                                 ".hypothesis", "tests", "benchmarks"))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("antiphon-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    page = {path.relative_to(ROOT).as_posix() for path in (ROOT / "frontend" / "web").iterdir()}
    kernels = {path.relative_to(ROOT).as_posix() for path in (ROOT / "workers" / "cpu" / "csrc").iterdir()
               if path.suffix in (".cpp", ".h", ".def")}
    assert page and page <= names, page - names
    assert kernels and kernels <= names, kernels - names

    # Installed into a fresh environment (the dependencies from this one), run from elsewhere:
    # the app serves its page from the installed package.
    environment = tmp_path / "venv"
    venv.create(environment, system_site_packages=True, with_pip=False)
    python = environment / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    str(wheel)], check=True, capture_output=True, timeout=300)
    probe = ("import frontend, frontend.app as app; from starlette.testclient import TestClient; "
             "from starlette.staticfiles import StaticFiles; "
             "page = TestClient(StaticFiles(directory=app.WEB_DIR, html=True)).get('/'); "
             "print(frontend.__file__); print(page.status_code, '<html' in page.text.lower())")
    out = subprocess.run([str(python), "-c", probe], cwd=tmp_path, check=True, capture_output=True, text=True,
                         timeout=300).stdout.split("\n")
    assert str(environment) in out[0] and str(ROOT) not in out[0], out
    assert out[1] == "200 True", out
