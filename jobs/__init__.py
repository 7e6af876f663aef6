"""Work that outlives the connection that asked for it, on JetStream: the file store
(``files``), batches (``batches``: their state and what creates them; ``batch_runner``:
the runners every bridge process runs), background responses (``background``), the
stored Responses API responses (``response_store``), and the in-process request a runner
makes to its own process's HTTP app (``inprocess``).

The gateway serves these over HTTP (``gateway.files_api``, ``gateway.batches_api``,
``gateway.responses_api``) and to NATS clients through ingress (the ``*State`` classes here).
This layer imports the contract, the kit, the actors and the dialects; never the gateway.

What they keep and send is typed once: the records (``job_records``), a batch's statuses
and the changes between them (``batch_status``), and what the runners, background responses
and batch creation need of the stores (``storage``, ``Protocol`` interfaces).
"""
