"""The two names fairseq-fixed's setup.py takes from ``torch.utils.cpp_extension``.

``CppExtension`` marks an extension that needs torch's headers and libraries;
``BuildExtension`` builds every other extension (libbleu and the two Cython modules, which
need only numpy) and drops the marked ones with one line each.  fairseq imports the dropped
modules lazily (``fairseq.libbase`` for BASE layers, ``fairseq.libnat`` for Levenshtein
NAT models) and says so if one is missing.
"""
from setuptools import Extension
from setuptools.command.build_ext import build_ext


def CppExtension(name, sources, *args, **kwargs):  # noqa: N802 (torch's name)
    ext = Extension(name, sources, *args, language="c++", **kwargs)
    ext.needs_torch = True
    return ext


class BuildExtension(build_ext):
    def finalize_options(self):
        # filtered here, before anything asks build_ext for its outputs
        super().finalize_options()
        for ext in self.extensions:
            if getattr(ext, "needs_torch", False):
                print(f"build shim: skipping {ext.name} (needs torch's C++ API)")
        self.extensions = [e for e in self.extensions if not getattr(e, "needs_torch", False)]
