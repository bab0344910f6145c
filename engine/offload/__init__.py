"""The tiers below the GPU pool: host memory and disk hold full prefix-cache blocks, copied as stored."""
