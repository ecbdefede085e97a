# model settings
num_classes = 4
model = dict(type='MLPClassifier', in_features=8, num_classes=num_classes, hidden=16)
