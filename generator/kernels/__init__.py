"""CuTe DSL kernel templates, by op and arch over shared feature modules:

    common/    features every template uses: the ABI entry point, tile lists, the online
               softmax, the Sage FP8 math
    sm90/      Hopper templates (TMA, wgmma)
    portable/  templates that run on every arch (mma.sync, CUDA cores)

A template module has make_kernel(variant), which returns an object whose @cute.jit
launch(args, stream) takes the family's ABI as one struct (common/entry.py).
"""
