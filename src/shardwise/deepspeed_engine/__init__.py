# Everything that runs a model under DeepSpeed's own engine, in one place (DeepSpeed itself is optional).
"""``sw.deepspeed()`` and what it needs: the model and optimizer handed to DeepSpeed's engine.

- ``transform.py``: the ``deepspeed()`` transform (a ``Distribution``): joins the process
  group, resolves the config, calls ``deepspeed.initialize``, puts the engine in the bundle.
- ``engine.py``: ``DeepSpeedEngine`` (the engine seam's answers under DeepSpeed: state dicts,
  memory, unwrap, and the step's two hooks, which drive ``engine.backward`` and
  ``engine.step`` at the pipeline's window boundaries).
- ``settings.py``: the one reader of a DeepSpeed config (a ``ds_config.json``, an Accelerate
  ``deepspeed_config`` block, the TrainingArguments fields the Trainer fills it from): one
  ``AUTO``, one contradiction rule (``merge``), and two outputs reading its settings:
- ``auto.py``: the JSON DeepSpeed's engine runs, its ``"auto"`` values resolved from the
  pipeline and the objects, as Transformers resolves them;
- ``config_file.py``: the DeepSpeed JSON to run, from a ``ds_config.json`` or an Accelerate
  ``distributed_type: DEEPSPEED`` YAML (``from_config(..., engine="deepspeed")``).

- and, outside this package, ``shardwise.configs.deepspeed``: the native transforms (ZeRO
  stage -> replicate / shard_optimizer / shard).

This package imports nothing on import, so the config readers can use ``settings.py``
without pulling in the transforms; it never imports ``shardwise.configs``.
"""
