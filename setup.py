"""Everything is in pyproject.toml; this file only installs the start-up hook.

``amsp_ext/integrations/amsp_ext_startup.pth`` must land at the root of site-packages, for a normal install (wheel)
and an editable one (``pip install -e .``, PEP 660). setuptools has no declarative way to ship a
top-level ``.pth``, so ``build_py`` copies it:

- normal build: into ``build_lib``, the root of the wheel's purelib (-> site-packages);
- editable build (``editable_mode``): ``editable_wheel`` points ``install_lib`` at the
  directory it zips into the editable wheel, so the file is written there. Its strategies
  only add their own ``__editable__*.pth``; anything else in that directory is installed.

The hook costs two environment-variable look-ups per interpreter start unless AMSP is asked
for (see amsp_ext/integrations/startup.py).
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "amsp_ext_startup.pth"
SOURCE = Path(__file__).resolve().parent / "amsp_ext" / "integrations" / PTH


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            target = Path(self.get_finalized_command("install").install_lib)
        else:
            target = Path(self.build_lib)
        target.mkdir(parents=True, exist_ok=True)
        self.copy_file(str(SOURCE), str(target / PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(str(Path(self.build_lib) / PTH))
        return outputs


if __name__ == "__main__":  # PEP 517 backends run this file as __main__; tests import the class
    setup(cmdclass={"build_py": build_py_with_pth})
