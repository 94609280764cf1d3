"""Only what pyproject.toml cannot say: `deltalab-lm-eval.pth` goes to the root of
site-packages, in regular and editable installs alike, so that `lm_eval --model deltalab`
finds the model (see _deltalab_lm_eval.py)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = Path(__file__).parent / "deltalab-lm-eval.pth"


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(PTH), str(Path(self.build_lib) / PTH.name))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH.name)]


class EditableWithPth(editable_wheel):
    # Everything in the unpacked wheel directory lands in site-packages; this hook is where
    # setuptools itself puts the files of namespace packages there.
    def _install_namespaces(self, installation_dir, pth_prefix):
        super()._install_namespaces(installation_dir, pth_prefix)
        shutil.copy(PTH, Path(installation_dir) / PTH.name)


setup(cmdclass={"build_py": BuildWithPth, "editable_wheel": EditableWithPth})
