"""The public writer and reader constructors, one module per cloud: thin subclasses of CloudWriter / CloudReader."""
