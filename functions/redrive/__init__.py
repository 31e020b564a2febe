"""RedriveFunction: Handler ``redrive.app.lambda_handler`` in the shared CodeUri, functions/."""
