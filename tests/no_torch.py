"""Python source to run first in a subprocess that must not import torch (the core, the replay): it installs an
import hook that raises AssertionError("torch imported") on any import of torch, so the check fails whether or
not torch is installed. ``subprocess.run([sys.executable, "-c", NO_TORCH + "import pagedkv ..."])``."""

NO_TORCH = ("import sys\n"
            "class _NoTorch:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch' or name.startswith('torch.'):\n"
            "            raise AssertionError('torch imported')\n"
            "sys.meta_path.insert(0, _NoTorch())\n")
