"""Vision encoders of vision-language models (issue 24): their image features replace the
image placeholder tokens' embeddings in the decoder's input."""
