"""The lab: the tools that study the library, not part of it.

``normbook.lab.specs`` (what each public call needs to be benchmarked, inspected and
checked), ``normbook.lab.inspector`` (what the compiler made of each kernel, without a
GPU), ``normbook.lab.bench`` (the benchmark), ``normbook.lab.timing`` and
``normbook.lab.notebook`` (the chapters' helpers), ``normbook.lab.op_count`` (what a
patched model still runs on PyTorch). The lab imports the library; the library imports
nothing of the lab, and ``import normbook`` loads none of it.
"""
