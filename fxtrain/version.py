"""fxtrain's version, below every layer: the cache keys its entries on it."""
__version__ = "0.1.0"
