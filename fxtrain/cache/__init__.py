"""On-disk cache of captured graphs: a fresh process skips dynamo and AOTAutograd on a hit."""
