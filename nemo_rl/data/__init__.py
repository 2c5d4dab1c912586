"""Data: tokenizer loading, datasets, processors (row -> message log), collate functions, the data loader.

Modules: :mod:`~nemo_rl.models.tokenizer` (``get_tokenizer``), :mod:`~nemo_rl.data.datasets`
(``setup_rl_data``, ``setup_sft_data``), :mod:`~nemo_rl.data.processors`, :mod:`~nemo_rl.data.llm_message_utils`,
:mod:`~nemo_rl.data.collate_fn`, :mod:`~nemo_rl.data.dataloader` (``StatefulDataLoader``) and
:mod:`~nemo_rl.data.tiny` (the tiny tokenizer, model and arithmetic data used by tests and CPU examples).
"""
