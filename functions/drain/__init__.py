"""DrainFunction: Handler ``drain.app.lambda_handler`` in the shared CodeUri, functions/."""
