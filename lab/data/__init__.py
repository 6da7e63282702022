"""Builders of data for the lab's measurements: the recipe's data shape at any size
(``make_scale_data``), real ShareGPT conversations without the Hub (``sharegpt_prefix``)."""
