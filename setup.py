"""The one step pyproject.toml cannot say: ``cfp_jax_quiet.pth`` installed beside the
packages, by a regular install and by ``pip install -e .``, so that ``_cfp_jax_quiet`` runs
at each Python start (see that module)."""
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "cfp_jax_quiet.pth"


class BuildWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


class EditableWithPth(editable_wheel):
    def _select_strategy(self, *args, **kwargs):
        strategy = super()._select_strategy(*args, **kwargs)
        text = Path(PTH).read_text()

        class WithPth(type(strategy)):
            def __call__(self, wheel, files, mapping):
                super().__call__(wheel, files, mapping)
                wheel.writestr(PTH, text)

        strategy.__class__ = WithPth
        return strategy


setup(cmdclass={"build_py": BuildWithPth, "editable_wheel": EditableWithPth})
