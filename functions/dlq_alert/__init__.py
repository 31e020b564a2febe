"""DlqAlertFunction: Handler ``dlq_alert.app.lambda_handler`` in the shared CodeUri, functions/."""
