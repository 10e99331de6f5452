"""Past one machine: several pdctl boxes behind an existing router (vllm-router), and an llm-d export.

The shared KV L1 must stay on the host of its GPUs (CUDA IPC), so the unit of scale is the whole box;
what spans boxes is routing, done by vllm-router. pdctl only plans, installs and observes it.

May import: settings, plan, twin, install, wire
"""
