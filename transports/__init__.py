"""Transport plugins. kvxfer finds them through the ``kvxfer.transports`` entry points."""
