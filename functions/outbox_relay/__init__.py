"""OutboxRelayFunction: Handler ``outbox_relay.app.lambda_handler`` in the shared CodeUri."""
