"""Evaluation tools, not part of the serving path: ``tokenbus bench`` (:mod:`.bench` and its
``bench_*`` parts) and its scenarios, the nemesis run (:mod:`.nemesis`, ``nemesis_*``), the
direct baseline server (:mod:`.direct`, ``tokenbus serve openai-http``), ``tokenbus report``
(:mod:`.report`) and the output-filter cost micro-benchmark (:mod:`.filter_cost`). Each module
and the command that runs it: docs/evaluation.md."""
