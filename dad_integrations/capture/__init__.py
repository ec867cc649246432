"""Capture of factors: forward/backward hooks that keep each layer call's input rows and output
gradient (`hooks`), the row helpers (`rows`), the factor units a model's weights form (`units`),
where synchronised gradients are written (`sink`), and one module per layer kind (`layers`)."""
