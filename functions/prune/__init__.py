"""PruneFunction: Handler ``prune.app.lambda_handler`` in the shared CodeUri, functions/."""
