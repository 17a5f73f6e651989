"""Framework adapters: translate arrays to and from (box, host buffer) pairs."""
