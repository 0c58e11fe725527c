"""Run at the start of every Python process of an environment cfp is installed in (through
``cfp_jax_quiet.pth``), and nothing more than this unless JAX is imported: on a machine
with JAX's CUDA plugin and no NVIDIA driver, the plugin's libraries, which JAX loads as it is
imported, say on the standard error that they find no CUDA driver. Before the first import
of JAX, ``cfp.gpu_compile.quiet_cuda_plugin`` loads them with that stream closed, whether
the script imports JAX or cfp first."""
import os
import sys


class _BeforeJax:
    """A finder that finds nothing: it only acts when ``jax`` is first looked for."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "jax":
            sys.meta_path.remove(_BeforeJax)
            from cfp.gpu_compile import quiet_cuda_plugin
            quiet_cuda_plugin()
        return None


if not os.path.exists("/proc/driver/nvidia/version") and "jax" not in sys.modules:
    sys.meta_path.insert(0, _BeforeJax)
