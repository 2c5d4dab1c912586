"""Generation backends behind one interface: the embedded pure-torch engine (default) and vLLM.

Start one with :func:`nemo_rl.models.generation.factory.create_generation`; the contract is
:class:`nemo_rl.models.generation.interfaces.GenerationInterface`.
"""
