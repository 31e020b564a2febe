"""The operator's tools: the on-call commands (``verbs``, ``cli_ops``, ``outbox_cli``), the
drain's report and interrupt handling, and the console (``console``). Never deployed."""
