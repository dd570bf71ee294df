"""The resource managers: each carries the core's decisions out on one kind of resource.

base.py holds the contract (ResourceManager, LiveAction, the Host protocol a manager sees
of its orchestrator) with the registry and MockManager; cpu.py runs calls in sandboxes
(tangram.runtime.sandbox.workers), gpu.py grants GPU memory and keeps GPU services resident,
inference.py starts vLLM and SGLang servers as such services, api.py admits calls to
rate-limited APIs. A new manager goes here, and into base.py's registry if it is built in.
"""
