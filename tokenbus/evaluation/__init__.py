"""Evaluation tools, not part of the serving path: ``tokenbus bench`` (:mod:`.bench`),
the direct baseline server (:mod:`.direct`, ``tokenbus serve openai-http``), ``tokenbus
report`` (:mod:`.report`) and the output-filter cost micro-benchmark (:mod:`.filter_cost`)."""
