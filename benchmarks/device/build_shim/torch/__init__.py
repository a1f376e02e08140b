"""Build-time stand-in for ``torch``, on PYTHONPATH only while benchmarks/device/build_wheels.py
builds fairseq-fixed's wheel; never installed, never carried to the device.

fairseq-fixed's setup.py imports ``torch.utils.cpp_extension`` unconditionally.  The device's
torch (2.11+cu130) cannot be imported here, and the C++ extensions that need torch (libbase,
libnat, alignment_train_cpu_binding) link against one torch build's C++ ABI and serve no code
path fastgen measures, so the device wheel is built without them: see cpp_extension.py.
"""
__version__ = "0+build-shim"
