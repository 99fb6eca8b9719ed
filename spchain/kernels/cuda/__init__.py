"""``@cuda.jit`` kernels (``<op>_kernel``) and their host launchers (``launch_<op>``).

Importing a module here imports ``numba.cuda``; spchain does so only on the CUDA path.
Under ``NUMBA_ENABLE_CUDASIM=1`` the same kernels run, slowly, on NumPy arrays.
"""
