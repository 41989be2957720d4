# Everything that runs a model under DeepSpeed's own engine, in one place (DeepSpeed itself is optional).
"""``sw.deepspeed()`` and what it needs: the model and optimizer handed to DeepSpeed's engine.

- ``transform.py``: the ``deepspeed()`` transform (a ``Distribution``): joins the process
  group, resolves the config, calls ``deepspeed.initialize``, puts the engine in the bundle.
- ``engine.py``: ``DeepSpeedEngine`` (the engine seam's answers under DeepSpeed: state dicts,
  memory, unwrap, and the step's two hooks, which drive ``engine.backward`` and
  ``engine.step`` at the pipeline's window boundaries).
- ``auto.py``: a config's ``"auto"`` values resolved from the pipeline and the objects, as
  Transformers resolves them; contradictions refused by key.
- ``config_file.py``: the DeepSpeed JSON to run, from a ``ds_config.json`` or an Accelerate
  ``distributed_type: DEEPSPEED`` YAML (``from_config(..., engine="deepspeed")``).

Reading a DeepSpeed config onto the *native* transforms (ZeRO stage -> replicate /
shard_optimizer / shard) is a config reader like the others: ``shardwise.configs.deepspeed``.
This package imports nothing on import, so config readers can use ``auto.py`` without
pulling in the transforms.
"""
